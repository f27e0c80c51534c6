"""One module per `colibri` subcommand, each with `main(argv) -> int`, imported lazily."""
