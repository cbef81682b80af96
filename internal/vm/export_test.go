package vm

// ConnectionLost exposes connectionLost to the external tests.
var ConnectionLost = connectionLost

// DescribeState exposes describeState to the external tests.
var DescribeState = describeState
