"""The drafting methods the runtime serves by name (``table.py``): training-free drafters and the loader of
trained exports with their tuned trees."""
