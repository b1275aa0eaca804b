"""What every package of phos may import, and which imports no other package of phos:
settings, the native library, key files."""
