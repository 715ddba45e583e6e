"""draftsmith.data."""
