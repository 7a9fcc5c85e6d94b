"""A tab's collaborators beside its widgets: its turns, its jobs, moving between branches,
the events they post, and the view of the tab they are given (not widgets themselves)."""
