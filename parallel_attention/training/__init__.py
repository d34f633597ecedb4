"""Training machinery: data pipeline, optimiser, loop and metrics (see DESIGN.md, layer 9)."""
