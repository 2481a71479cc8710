"""The trust tools' work: ``doctor`` (static checks), ``explain`` (why two τ differ), ``parity``
(online speculative decoding against the offline eval), ``compare-backends``."""
