"""The Textual app: a thin layer over the engine (see docs/architecture.md, "Front ends")."""
