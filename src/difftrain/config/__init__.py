"""Configuration: the pydantic schema (schema/, one module per section), layered loading (load.py), recipes (recipes.py)."""
