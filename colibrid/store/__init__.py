"""Weights on disk and in memory: safetensors files, checkpoints, containers, experts.

The store never knows what a model is; models never know where an expert lives.
"""
