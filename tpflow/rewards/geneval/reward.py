"""Reward geneval (issue 6): being written."""
