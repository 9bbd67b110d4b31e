"""What every Lion Cub optimizer shares: the vote settings (:mod:`.config`) and the shell
around a step (:mod:`.shell`: world, closure, same-parameters check and broadcast, the
non-finite policy, the replica-check cadence, one state envelope)."""
