"""Process groups, the device mesh, and the functions that apply data parallelism to a model."""
