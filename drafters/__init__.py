"""draftsmith.drafters."""
