"""Attention kernels: torch for the CPU (attention.py), Triton for GPUs."""
