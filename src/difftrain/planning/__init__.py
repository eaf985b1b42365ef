"""What a config trains and loads, and the planner's estimate for it: no weight is read.

``difftrain plan``, ``train``'s memory pre-check, ``bench`` and ``doctor`` ask these questions before anything
loads, and the trainer asks the same ones when it builds the parts (trainers/setup.py): one answer for all,
without importing the trainer. ``parts``: what loads and trains; ``estimate``: the planner's figures;
``engines``: memory.engine ``auto`` on several processes and its measured scaling.
"""
