"""Thin front ends: the `attnpat` CLI and the Gradio web app."""
