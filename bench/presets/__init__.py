"""Workload presets shipped as package data (chat, rag, mixed, steady, multi_turn,
shared_corpus)."""
