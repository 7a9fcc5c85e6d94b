"""Screens and modal dialogs."""
