// kstatus-check prints what sigs.k8s.io/cli-utils' kstatus computes for each object given on
// stdin (a YAML or JSON stream): one JSON line {"name", "status", "message"} per object. The
// operator's end-to-end and unit tests feed it ReportsServer objects.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	dec := yaml.NewYAMLOrJSONDecoder(os.Stdin, 4096)
	out := json.NewEncoder(os.Stdout)
	for {
		// Raw JSON, then Unstructured's own decoder: integers stay int64 (a generic map would
		// turn metadata.generation into float64, which kstatus rejects).
		var raw json.RawMessage
		if err := dec.Decode(&raw); err == io.EOF {
			return
		} else if err != nil {
			fmt.Fprintln(os.Stderr, "decode:", err)
			os.Exit(2)
		}
		if len(raw) == 0 || string(raw) == "null" {
			continue
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(raw); err != nil {
			fmt.Fprintln(os.Stderr, "decode:", err)
			os.Exit(2)
		}
		res, err := status.Compute(u)
		if err != nil {
			fmt.Fprintln(os.Stderr, "compute:", err)
			os.Exit(1)
		}
		_ = out.Encode(map[string]string{"name": u.GetName(), "status": res.Status.String(), "message": res.Message})
	}
}
