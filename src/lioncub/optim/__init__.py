"""The optimizers: LionCub (every step votes), LocalCub (local steps, then an agreed outer step),
NodeCub (average inside a node, vote across nodes), and LocalCub's outer rules."""
