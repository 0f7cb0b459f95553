"""Jinja2 templates used by the implementer (package data)."""
