"""What is trained: the decoder, its inner optimizer and jitted steps, the data, the evaluation.

Knows nothing of learners, syncers or fragments beyond the flat parameter names they use; another
model or data pipeline replaces this package without touching `algorithm` or `runtime`.
"""
