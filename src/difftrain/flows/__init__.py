"""Flows built from the layers below, each behind one command: ``sweep`` (many trainings over one cache),
``bench`` (speed and memory on random weights), ``doctor`` (what this machine supports) and ``quickstart`` (the
whole flow on a tiny seeded model)."""
