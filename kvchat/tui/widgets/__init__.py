"""Widgets, grouped by the part of the screen they draw."""
