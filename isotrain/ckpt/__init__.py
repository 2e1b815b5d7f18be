"""Offline checkpoint tools, the `isotrain ckpt list|inspect|verify|export|merge` commands.

A package of its own, named after the command it serves (not `tools/`, which would collect
unrelated things): these run on checkpoints after training, in a separate process, and read
them with the training-time engine in `isotrain/checkpoint/` (reader, manifest, layout, files).
The dependency goes one way: tools import the engine, the engine never imports the tools, so a
change to a tool's output can never change how a run saves or resumes.
"""
