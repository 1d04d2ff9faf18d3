"""Dataset geneval (issue 6): being written."""
