"""The front doors: the frameworks most DeepSpeed users train through, driving the ZeRO engine.

One module per framework, each imported only by a user of that framework (none of them is imported here, and none
imports another): ``elasticzero.integrations.hf`` (the Hugging Face ``Trainer``), ``.accelerate`` (an
``Accelerator``-based loop, ``accelerate launch``), ``.lightning`` (a Lightning ``Strategy``). Each builds on the
engine, the checkpointer and the training object, never on a copy of their protocol (docs/integrations-*.md).
"""
