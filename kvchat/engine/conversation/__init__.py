"""A conversation: the Session and its token ledger, its maintenance (trim, undo, kind switch), branches, templates, events and stats."""
