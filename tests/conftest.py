from __future__ import annotations

import os

import torch

# Two cores: keep torch from oversubscribing them when pytest runs beside other processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))
