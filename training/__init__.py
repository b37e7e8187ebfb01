"""Teacher-data tooling for training a small Fish-architecture voice (issue 6): corpus, text normaliser, Piper
teacher synthesis and the Whisper word-error-rate gate.

Not part of the served product: nothing under model/, streaming/ or server/ imports this package. Its optional
dependencies (numpy, soundfile, soxr, and in a separate venv piper-tts, faster-whisper) are listed in README.md.
"""
