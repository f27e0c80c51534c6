"""The serving side of the daemon: requests, events, the scheduler, SERVE sessions and the
Unix-socket listener. Front ends talk to the scheduler only, never to the engine."""
