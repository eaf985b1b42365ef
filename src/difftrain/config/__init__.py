"""Configuration: pydantic schema (schema.py), layered loading (load.py), recipes (recipes.py)."""
