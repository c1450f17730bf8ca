"""The operator's routes: /admin and the status page."""
