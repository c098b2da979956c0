"""Byte units, in one place."""

KIB = 2**10
MIB = 2**20
GIB = 2**30
