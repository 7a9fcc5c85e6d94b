"""The Textual app: a thin layer over the engine (see DESIGN.md, "TUI")."""
