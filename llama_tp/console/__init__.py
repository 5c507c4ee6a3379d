"""The command line and the terminal: shared flags and error lines, terminal
modes, the line editor."""
