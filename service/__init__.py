"""The Anytime service and its command line."""
