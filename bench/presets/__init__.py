"""Workload presets shipped as package data (chat, rag, mixed, steady, multi_turn, long_chat,
shared_corpus)."""
