"""The ``smp-fx`` command line; ``main.py`` dispatches to one module per subcommand."""
