"""Autolab: an autoresearch lab run as a declarative controller."""
