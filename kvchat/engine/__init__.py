"""The engine: model loading, cache kinds, Session and stats. Imports no Textual."""
