// argocd-lua-health runs a resource health check written in Lua with Argo CD's own Lua runner
// (github.com/argoproj/argo-cd/v3/util/lua), the code Argo CD uses for
// resource.customizations.health.<group>_<kind>. Usage:
//
//	argocd-lua-health health.lua < objects.yaml
//
// prints one JSON line {"name", "status", "message"} per object of the YAML/JSON stream.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/argoproj/argo-cd/v3/util/lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: argocd-lua-health SCRIPT.lua < objects.yaml")
		os.Exit(2)
	}
	script, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	vm := lua.VM{}
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
		hs, err := vm.ExecuteHealthLua(u, string(script))
		if err != nil {
			fmt.Fprintln(os.Stderr, "lua:", err)
			os.Exit(1)
		}
		_ = out.Encode(map[string]string{"name": u.GetName(), "status": string(hs.Status), "message": hs.Message})
	}
}
