"""draftsmith.inference."""
