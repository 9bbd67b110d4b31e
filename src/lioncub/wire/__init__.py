"""The bytes on the wire: lane packing rules and the word-level kernels that pack and count them."""
