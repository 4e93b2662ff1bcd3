package harness

import "testing"

func TestReleaseMinor(t *testing.T) {
	for version, want := range map[string]int{
		"v1.34.12":                 34,
		"Kubernetes v1.37.1\n":     37,
		"v1.36.0-rc.1":             36,
		"v0.0.0-master+$Format:%H": -1,
		"":                         -1,
	} {
		if got := ReleaseMinor(version); got != want {
			t.Errorf("ReleaseMinor(%q) = %d, want %d", version, got, want)
		}
	}
}
