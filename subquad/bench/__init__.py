"""Measurement: memory accounting, the workshop, plots and tables."""
