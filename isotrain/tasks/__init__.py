"""Small built-in tasks that ship with the package (data generators and their scorers)."""
