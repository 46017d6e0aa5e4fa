"""Widgets and views: job setup form, live dashboard, job view. Only the notebook side imports this."""
