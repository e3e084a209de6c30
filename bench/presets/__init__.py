"""Workload presets shipped as package data (chat, rag, mixed, steady)."""
