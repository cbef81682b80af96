package vm

// ConnectionLost exposes connectionLost to the external tests.
var ConnectionLost = connectionLost
