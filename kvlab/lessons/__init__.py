"""Longer setup and drawing code for the lesson notebooks (one module per lesson), so
the notebooks' cells stay short. Nothing here is part of the engine."""
