"""The SERVE line protocol between colibrid and its clients (shipped as colibri_protocol).

Its specification, conformance vectors and codec arrive with the daemon (issue 5).
"""
