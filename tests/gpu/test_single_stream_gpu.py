"""Z-Image, Krea 2, FLUX.2 [klein] and Qwen-Image recipes on a CUDA GPU (issues 52-53; skipped elsewhere): each shipped tier
recipe, on random weights of its full-size architecture, trains three steps through the console script
(`difftrain bench memory --card`) with torch's allocator capped as its card would leave it, with finite losses and
host RAM inside its desktop's budget. What benchmarks/card_fit.py measured for docs/benchmarks.md, as a test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import recipe_as_its_card

pytestmark = pytest.mark.gpu

# one random model per architecture, reused by that family's recipes (each 12-41 GB on disk: removed at the end)
WORK = Path(os.environ.get("DIFFTRAIN_SINGLE_STREAM_GPU_WORK", "/tmp/difftrain-single-stream-gpu"))

RECIPES = [
    "zimage-lora-12gb",
    "zimage-lora-6gb",
    "krea2-lora-24gb",
    "krea2-lora-12gb",
    "krea2-lora-8gb",
    "krea2-full-24gb",
    "flux2-klein-4b-lora-8gb",
    "flux2-klein-4b-lora-6gb",
    "flux2-klein-9b-lora-16gb",
    "flux2-klein-9b-lora-8gb",
    "qwen-image-lora-16gb",
    "zimage-lora-24gb",
    "zimage-lora-32gb",
    "krea2-lora-48gb",
    "qwen-image-lora-12gb",
    "qwen-image-lora-24gb",
    "qwen-image-edit-lora-24gb",
    "qwen-image-edit-lora-16gb",
    "qwen-image-lora-48gb",
    "flux2-klein-4b-full-24gb",
    "flux2-dev-lora-24gb",
    "flux2-klein-9b-lora-24gb",
    "flux2-klein-9b-lora-48gb",
    "flux2-klein-4b-lora-24gb",
    "qwen-image-2.1-lora-12gb",
    "qwen-image-2.1-lora-24gb",
    "qwen-image-2.1-lora-16gb",
    "flux2-dev-lora-16gb",
    "qwen-image-edit-lora-80gb",
    "flux2-dev-lora-96gb",
]


@pytest.fixture(scope="module", autouse=True)
def _clean_work():
    yield
    shutil.rmtree(WORK, ignore_errors=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_inside_its_card_and_desktop(recipe, tmp_path):
    recipe_as_its_card(recipe, WORK / recipe.split("-lora")[0].split("-full")[0], tmp_path)
