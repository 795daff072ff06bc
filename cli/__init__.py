"""The `anytime` command line: one module per subcommand, on top of everything else."""
