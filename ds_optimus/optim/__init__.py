"""The EP-aware sharded optimizer (`sharded`) and its parts; import the submodules directly."""
