"""The `ember` command line: one entry point (`main`), one module per subcommand."""
